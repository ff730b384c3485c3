from bench.harness import run_study
from bench.quality import STUDIES, __doc__

run_study("quality", STUDIES, None, __doc__)
