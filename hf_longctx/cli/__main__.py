"""`python -m hf_longctx.cli`: the `hf-longctx` command."""

import sys

from hf_longctx.cli.main import main

sys.exit(main())
