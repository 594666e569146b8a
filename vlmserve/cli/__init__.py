"""The `vlmserve` command and its subcommands."""
