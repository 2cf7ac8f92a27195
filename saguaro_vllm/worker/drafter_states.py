"""The drafter client's states, in one place both the client and the metrics import (the
`vllm:saguaro_drafter_state` gauge has one label per state), so neither imports the other."""

STARTING, READY, LATE, RESTARTING, DISABLED = "starting", "ready", "late", "restarting", "disabled"
STATES = (STARTING, READY, LATE, RESTARTING, DISABLED)
