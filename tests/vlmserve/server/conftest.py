"""The server tests need the server's libraries and the openai client they drive it with.
Where one is missing (a GPU machine's own environment, before or without its bundle) this
folder's tests are not collected, rather than each erroring at import."""

import importlib.util


def missing(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is None
    except ImportError:  # a finder that refuses it outright
        return True


MISSING = [name for name in ("fastapi", "uvicorn", "openai") if missing(name)]
collect_ignore_glob = ["test_*.py"] if MISSING else []
