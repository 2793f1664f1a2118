"""The engine core: scheduler, KV block manager and model runner. It sees token ids only."""
