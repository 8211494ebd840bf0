"""The ray backend: code runs on a node of a Ray cluster, inside that node's own sandbox backend.

backend.py is the driver side (the ExecutionBackend: placement, the guard's view of the nodes, failures); node.py is
the host actor each node runs, which drives that node's execbox through its public API.
"""
