import sys

from deepserve.cli import main

sys.exit(main())
