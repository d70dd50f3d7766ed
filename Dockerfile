# srl actor/trainer image (CPU torch), run as an unprivileged user. Build: docker build -t srl .
# Credentials come from the environment (SRL_REDIS_URL, SRL_REDIS_PASSWORD,
# SRL_QUEUE_URL, SRL_SECRET): none is baked into the image.
FROM python:3.11-slim
WORKDIR /srl
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# the CPU wheel first: a bare torch requirement pulls several GB of CUDA packages
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0"
COPY pyproject.toml constraints.txt README.md ./
COPY srl ./srl
RUN pip install -c constraints.txt ".[all]"
# nodes write nothing and need no privilege: they never run as root
RUN groupadd --system --gid 10001 srl \
    && useradd --system --uid 10001 --gid srl --create-home --home-dir /home/srl --shell /usr/sbin/nologin srl
USER 10001:10001
ENTRYPOINT ["srl"]
CMD ["--help"]
