"""Scale-out on Ray Serve (``kvkeeper serve --replicas N``, extra ``kvkeeper[cluster]``).

:mod:`.router` is the routing policy (no Ray); :mod:`.config` the options; :mod:`.metrics_text` joins
the replicas' Prometheus pages; :mod:`.deployment` the Ray Serve glue (imports Ray).
"""
