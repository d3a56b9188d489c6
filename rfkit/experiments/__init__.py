"""Multi-run studies built on the pipeline: ``rfkit bench`` (cache, speed), ``rfkit sweep``
(quality against cache) and ``rfkit eval mqar`` (synthetic recall), with their plots.
"""
