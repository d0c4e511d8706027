"""The parameter server's runtime on Dask: the PSNode actor that carries out a node's protocol
(:mod:`.node`), the scheduler plugin that carries out the controller's decisions
(:mod:`.plugin`), and calling an actor's method by address from anywhere (:mod:`.rpc`)."""
