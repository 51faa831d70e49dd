import sys

from diffusers_nki.cli import main

sys.exit(main())
