"""The parameter server's client: the public handle ``ParameterServer`` (:mod:`.server`), how
one is made or restored (:mod:`.build`), the ``Courier`` that carries every request
(:mod:`.courier`) and the Dask side of it, for control (:mod:`.control`)."""
