"""The suite's ranks start from a forkserver that imported torch and flexshard once
(``flexshard.testing.launch``): each launch then costs a fork instead of every rank's
interpreter start and imports (seconds each on two cores), with the same fresh module
state as spawn. Set before any launch, so the server starts with this environment."""

import os

from flexshard.testing.launch import START_METHOD_ENV

os.environ.setdefault(START_METHOD_ENV, "forkserver")
