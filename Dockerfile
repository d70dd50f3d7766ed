# srl actor/trainer image, run as an unprivileged user. Build: docker build -t srl .
# CPU torch by default; a GPU trainer's image takes a CUDA build of the same torch:
#   docker build -t srl:cuda --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
# Credentials come from the environment (SRL_REDIS_URL, SRL_REDIS_PASSWORD,
# SRL_QUEUE_URL, SRL_SECRET): none is baked into the image.
FROM python:3.11-slim
WORKDIR /srl
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# torch first, from the index chosen: a bare torch requirement pulls several GB of CUDA packages
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install --index-url "$TORCH_INDEX" "torch==2.13.0"
COPY pyproject.toml constraints.txt README.md ./
COPY srl ./srl
# the examples' client (deploy/k8s's client Job runs examples/distribution/client.py)
COPY examples ./examples
RUN pip install -c constraints.txt ".[all]"
# nodes write nothing and need no privilege: they never run as root
RUN groupadd --system --gid 10001 srl \
    && useradd --system --uid 10001 --gid srl --create-home --home-dir /home/srl --shell /usr/sbin/nologin srl
USER 10001:10001
ENTRYPOINT ["srl"]
CMD ["--help"]
