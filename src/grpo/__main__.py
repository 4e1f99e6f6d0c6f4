"""`python -m grpo ...`, the same as the `grpo` command; what torchrun starts:
`torchrun --nproc_per_node N -m grpo train CONFIG`."""

import sys

from grpo.cli import main

sys.exit(main())
