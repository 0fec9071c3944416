import sys

from megatron_lora.cli import main

sys.exit(main())
