"""Other engines measured beside ours on one machine: `python -m benchmark.peers`."""
