import sys

from tritonctl.cli import main

sys.exit(main())
