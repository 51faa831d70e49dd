"""``python -m diffusers_nki_lab.prodcases --report``: the production-kernel coverage report (``prodcases.main``)."""
from . import main

raise SystemExit(main())
