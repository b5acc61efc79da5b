"""Lets a plain Python object that holds DSL values (Int32s, register tensors) live across
dynamic control flow: the DSL rebuilds objects carried through a run-time `if`/`for` from
the IR values they expose. Python-level attributes (ints, bools) stay compile-time."""

import copy

import cutlass


class Staged:
    def __extract_mlir_values__(self):
        values = []
        for v in self.__dict__.values():
            values += cutlass.extract_mlir_values(v)
        return values

    def __new_from_mlir_values__(self, values):
        new = copy.copy(self)
        for name, v in self.__dict__.items():
            n = len(cutlass.extract_mlir_values(v))
            new.__dict__[name] = cutlass.new_from_mlir_values(v, values[:n])
            values = values[n:]
        return new
