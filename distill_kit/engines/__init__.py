"""DeepSpeed configs, loading models under the right ZeRO layout, building the engines, distributed start-up."""
