import sys

from kilovla.cli import main

sys.exit(main())
