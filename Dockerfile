# tiercache: the cache daemon and the HTTP API on CPU torch, for a NAS (compose.yaml runs both).
#   docker build -t tiercache .        (or: podman build -t tiercache .)
FROM python:3.11-slim-bookworm

# CPU torch from PyTorch's own index: PyPI's Linux wheels pull several GB of CUDA libraries.
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN pip install --index-url "$TORCH_INDEX" "$TORCH_SPEC"

WORKDIR /opt/tiercache
COPY pyproject.toml README.md ./
COPY tiercache ./tiercache
COPY server ./server
RUN pip install ".[api]"
COPY deploy/container/entrypoint.sh /usr/local/bin/tiercache-entrypoint
COPY deploy/tiercache.toml /etc/tiercache/tiercache.example.toml

RUN useradd --system --uid 10001 --home-dir /var/lib/tiercache tiercache \
 && mkdir -p /var/lib/tiercache /run/tiercache && chown tiercache /var/lib/tiercache /run/tiercache
USER tiercache
VOLUME ["/var/lib/tiercache", "/run/tiercache"]
EXPOSE 8000 9464
ENTRYPOINT ["tiercache-entrypoint"]
CMD ["daemon"]
