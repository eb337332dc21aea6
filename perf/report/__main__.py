import sys

from perf.report.make_report import main

sys.exit(main())
