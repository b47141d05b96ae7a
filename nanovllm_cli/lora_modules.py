"""`--lora-modules name=path`: the LoRA adapters a job's rows may name, and which adapter a row names.

A plain row names its adapter by module name in its `lora` field (absent or null: the base model); an OpenAI
batch line by its body's `model`, which is then either a module name or the base model's name (as given to
--model, or the engine's name for it). Each module becomes one `LoRARequest`, with ids 1, 2, ... in the order of
the option; the engine reads and checks an adapter when its first row arrives, and a row whose adapter it
cannot run gets an error record."""
from __future__ import annotations

from dataclasses import dataclass

from nanovllm import LoRARequest


@dataclass(frozen=True)
class LoRAModules:
    requests: dict[str, LoRARequest]  # module name -> its adapter
    base_names: frozenset[str] = frozenset()  # what an OpenAI line's `model` may say for the base model

    @classmethod
    def parse(cls, specs: list[str]) -> LoRAModules:
        """From the values of --lora-modules; raises ValueError naming the option."""
        requests: dict[str, LoRARequest] = {}
        for spec in specs:
            name, sep, path = spec.partition("=")
            name, path = name.strip(), path.strip()
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules {spec!r}: give each adapter as NAME=PATH (a PEFT adapter folder or "
                                 "a Hugging Face Hub id)")
            if name in requests:
                raise ValueError(f"--lora-modules names {name!r} twice")
            requests[name] = LoRARequest(name, len(requests) + 1, path)
        return cls(requests)

    def with_base_names(self, *names: str | None) -> LoRAModules:
        """The same modules, an OpenAI line's `model` naming the base model by any of `names`."""
        clash = sorted(n for n in names if n in self.requests)
        if clash:
            raise ValueError(f"--lora-modules name {clash[0]!r} is also the base model's name: rename the module")
        return LoRAModules(self.requests, frozenset(n for n in names if n))

    def for_row(self, name: object) -> LoRARequest | None:
        """A plain row's `lora` field -> its adapter (None: the base model); raises ValueError saying why not."""
        if name is None:
            return None
        if not isinstance(name, str):
            raise ValueError(f"'lora' must be the name of a --lora-modules adapter, not {type(name).__name__}")
        if name not in self.requests:
            raise ValueError(f"'lora' names {name!r}, which is not {self._known()}")
        return self.requests[name]

    def for_model(self, model: object) -> LoRARequest | None:
        """An OpenAI line's body.model -> its adapter (None: the base model, or no model given)."""
        if model is None or model in self.base_names:
            return None
        if not isinstance(model, str):
            raise ValueError(f"body.model must be a string, not {type(model).__name__}")
        if model not in self.requests:
            base = " or ".join(repr(n) for n in sorted(self.base_names))
            raise ValueError(f"body.model {model!r} is neither the base model ({base}) nor {self._known()}")
        return self.requests[model]

    def _known(self) -> str:
        if not self.requests:
            return "an adapter of the job: it has no --lora-modules"
        return f"one of the job's --lora-modules ({', '.join(self.requests)})"


NO_MODULES = LoRAModules({})
