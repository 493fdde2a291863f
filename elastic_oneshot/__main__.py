import sys

from elastic_oneshot.surface.cli import main

sys.exit(main())
