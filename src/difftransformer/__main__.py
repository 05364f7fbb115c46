"""`python -m difftransformer ...` is the `difftransformer` command (see difftransformer.cli)."""

from difftransformer.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
