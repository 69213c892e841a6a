"""What the evaluations and the recipes share about running a causal LM: the model as body + head with chunked NLL
and greedy decoding (causal), its text: documents, tokenizers, cached tokenization (text), and the memory and time a
run will take, estimated before it starts (budget).
"""
