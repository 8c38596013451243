"""Prints, as JSON, the audit counts of the data-flow case named by argv[1] (support.data_flow),
run in the engine named by argv[2], which must be the engine this interpreter runs."""

import json
import sys

import sac_plugin
from support.data_flow import CASES

case, engine = sys.argv[1:]
assert sac_plugin.engine() == engine, sac_plugin.engine()
print(json.dumps(CASES[case]()))
