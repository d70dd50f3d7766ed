# srl actor/trainer image (CPU torch). Build: docker build -t srl .
FROM python:3.11-slim
WORKDIR /srl
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0"
COPY pyproject.toml constraints.txt README.md ./
COPY srl ./srl
RUN pip install -c constraints.txt ".[all]"
ENTRYPOINT ["srl"]
CMD ["--help"]
