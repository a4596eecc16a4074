"""The experience bank: SQLite store, observation-lite text, embeddings, FAISS index, retrieval.

    records  parse/validate one JSONL rollout line      store     Bank (SQLite), BankItem
    lite     observation-lite rendering                 embed     sentence-transformers loading
    index    FAISS flat/HNSW + id map, build_index       retrieve  Retriever
"""
