"""`python -m vlmserve.cli ...` is the `vlmserve` command."""

from vlmserve.cli.main import main

if __name__ == "__main__":
    main()
