"""The descriptor pool that holds cadence's copy of the Open Inference Protocol.

tritonclient ships its own compiled copy of the same protocol and registers the names
(`inference.ModelInferRequest`, ...) in protobuf's default pool; a pool refuses a second
definition of a name, so a process that imported both would fail. The stubs in this package
are generated to register here instead (scripts/generate_stubs.py), which lets a program
run cadence's server and tritonclient side by side. Server reflection reads this pool as
well as the default one (`ReflectionPool`).
"""

from __future__ import annotations

from google.protobuf import descriptor_pool

POOL = descriptor_pool.DescriptorPool()


class ReflectionPool:
    """This package's pool, then protobuf's default one: what server reflection describes.

    Server reflection reads one pool; cadence's own API, health and reflection itself live in
    the default pool and the Open Inference Protocol here. Only the lookups reflection makes
    are forwarded; each raises KeyError when neither pool has the name.
    """

    def __init__(self) -> None:
        self._pools = (POOL, descriptor_pool.Default())

    def _first(self, lookup: str, *args):
        for pool in self._pools:
            try:
                return getattr(pool, lookup)(*args)
            except KeyError:
                continue
        raise KeyError(args[0])

    def FindFileByName(self, name: str):
        return self._first("FindFileByName", name)

    def FindFileContainingSymbol(self, symbol: str):
        return self._first("FindFileContainingSymbol", symbol)

    def FindMessageTypeByName(self, name: str):
        return self._first("FindMessageTypeByName", name)

    def FindExtensionByNumber(self, message, number: int):
        return self._first("FindExtensionByNumber", message, number)

    def FindAllExtensions(self, message):
        for pool in self._pools:
            try:
                return pool.FindAllExtensions(message)
            except KeyError:
                continue
        return []
