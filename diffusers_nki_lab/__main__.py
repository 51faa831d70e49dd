import sys

from diffusers_nki_lab.cli import main

sys.exit(main())
