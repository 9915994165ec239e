import sys

from tmac.apps.console import main

sys.exit(main())
