import sys

from ftrain.cli import main

sys.exit(main())
