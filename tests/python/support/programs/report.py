"""report(), which every program run through support.accelerator ends with: the test reads the
JSON object on the last line it prints."""

import json


def report(**values):
    print(json.dumps(values))
