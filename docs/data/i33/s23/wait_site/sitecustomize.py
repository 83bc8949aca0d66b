import os
_us = os.environ.get("X_WAIT_US")
if _us:
    import sys
    from hpccomm.collectives import transport
    transport.set_wait_interval(float(_us) * 1e-6)
    sys.stderr.write(f"[wait interval {_us} us in pid {os.getpid()}]\n")
