"""Remote engines as backends: any OpenAI-compatible server, vLLM, SGLang, TGI."""
