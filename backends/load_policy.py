"""What the operator's daemon settings allow a model's own files and config
to reach, handed to the backend with each load.

A model's config and files may come from a client (an inline upload), so
nothing in them alone may make the daemon read an environment variable,
call a host or load native code the operator did not allow. The engine
stamps the daemon's policy into every ModelConfig it loads
(`ModelConfig.policy`), so a backend in a worker process gets it with the
config; the default is the locked one a config parsed without the daemon
gets.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoadPolicy:
    # environment variables a remote model's [remote] api_key_env may name
    # (setting remote_api_key_envs); empty: none, so no key ever leaves
    remote_api_key_envs: frozenset[str] = frozenset()
    # hosts (names or addresses) remote engines may be at (remote_allowed_hosts);
    # empty: any host that is not link-local or a cloud metadata service
    remote_allowed_hosts: tuple[str, ...] = ()
    # genai_config.json keys that load code or write files, let through by
    # name (onnx_genai_allowed_keys), e.g. "custom_ops_library"
    onnx_genai_allowed_keys: frozenset[str] = frozenset()
    # where compiled modules are kept (iree_cache_dir); "": the daemon's
    # default under the user's cache directory
    iree_cache_dir: str = ""
    # (model name, template file) the operator gave (--chat-template NAME=FILE):
    # it replaces the model's own template and model.toml's chat_template
    chat_templates: tuple[tuple[str, str], ...] = ()

    def chat_template_for(self, model: str) -> str:
        return next((path for name, path in self.chat_templates if name == model), "")
