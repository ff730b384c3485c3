"""vLLM general plugin (entry point `vllm.general_plugins: leap_sparse`): registers the `leap_sparse`
quantization method that serving checkpoints name in their `quantization_config`.

vLLM calls `register` in the API server, the engine core and every worker process, so it must be
idempotent and cheap."""

from serving.contract import QUANT_METHOD


def register() -> None:
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, register_quantization_config

    if QUANT_METHOD in QUANTIZATION_METHODS:
        return
    from serving.leap_sparse import LeapSparseConfig

    register_quantization_config(QUANT_METHOD)(LeapSparseConfig)
