"""The model: Transformer (CED backbone), attention (CSA2), mHC, DeepSeekMoE, Engram, RoPE."""
