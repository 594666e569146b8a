"""The documentation site's sources (mkdocs.yml at the root) and its generator, `docs.gen`."""
