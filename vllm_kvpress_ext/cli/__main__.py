"""`python -m vllm_kvpress_ext.cli`: the `kvpress` command."""

import sys

from vllm_kvpress_ext.cli import main

sys.exit(main())
