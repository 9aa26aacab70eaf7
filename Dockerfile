# ironcell for macOS (and any Docker host): the Linux VM's kernel provides Landlock and seccomp.
#
#   docker build -t ironcell .                      # with node (npx) and uv (uvx): proxies the usual servers
#   docker build --target slim -t ironcell:slim .   # Python only, about 150 MB smaller
#   docker run --rm ironcell doctor                 # FIRST: can this Docker VM sandbox? (exit 0 = ready)
#   docker run -i --rm --init ironcell serve        # MCP on stdin/stdout: what Claude Desktop runs
#
# `ironcell setup --client docker` (run anywhere, e.g. `docker run --rm ironcell setup --client
# docker --allow-read /Users/you/project`) prints the entry for Claude Desktop's config. The
# container needs no extra privileges: ironcell sandboxes each worker itself. `--init` gives it
# a real PID 1 (signals, zombies). Settings: flags after `serve`, or `-e NAME=value` before the
# image (Claude's "env" only reaches the docker CLI). A folder of yours: `-v /Users/you/p:/data/p:ro`
# plus `--allow-read /data/p` (or `--allow-write` without `:ro`). The code runs in the image's
# python3 (Debian 12's 3.11 with numpy, pandas, matplotlib); to use another, derive an image that
# installs it and set IRONCELL_PYTHON (an interpreter, a venv or a conda env prefix).

# The build needs no Python: the extension uses the stable ABI and links no libpython.
FROM rust:1-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock build.rs clippy.toml ./
COPY .cargo .cargo
COPY crates crates
COPY src src
COPY python python
COPY sandbox-policy sandbox-policy
RUN cargo build --release --locked && strip target/release/ironcell

FROM debian:bookworm-slim AS slim
RUN apt-get update && apt-get install -y --no-install-recommends \
        python3 python3-numpy python3-pandas python3-matplotlib tzdata \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 1000 ironcell
COPY --from=build /src/target/release/ironcell /usr/local/bin/ironcell
USER 1000
ENV MCP_BRIDGE_STATE_DIR=/home/ironcell/state
ENTRYPOINT ["/usr/local/bin/ironcell"]
CMD ["serve"]

# The default image: node/npm (npx) from Debian 12 and uv (uvx) from PyPI, so the MCP servers
# people usually configure (`npx -y @modelcontextprotocol/server-…`, `uvx mcp-server-…`) can be
# proxied from inside the container. They run as the ironcell user, outside the worker sandbox,
# like any proxied server.
FROM slim AS full
USER 0
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN apt-get update && apt-get install -y --no-install-recommends nodejs npm python3.11-venv ca-certificates git \
    && rm -rf /var/lib/apt/lists/* \
    && python3.11 -m venv /opt/uv \
    && /opt/uv/bin/pip install --no-cache-dir uv==0.13.8 \
    && ln -s /opt/uv/bin/uv /opt/uv/bin/uvx /usr/local/bin/
USER 1000
