"""The model layer: the Llama-family forward over the paged pool and its one input, the step
descriptor. Imports only `jaxinfer.config`, `jaxinfer.sharding` and `pallas_kernels`."""

from jaxinfer.model.batch import CHUNK, DECODE, QueryGroup, StepBatch
from jaxinfer.model.llama import Llama
from jaxinfer.model.params import expected_shapes, init_params

__all__ = ["CHUNK", "DECODE", "Llama", "QueryGroup", "StepBatch", "expected_shapes",
           "init_params"]
