"""Pretrained models in the Hugging Face layout, loaded into npformer's own modules.

* :mod:`npformer.pretrained.bert`: BERT directories (all-MiniLM-L6-v2) into ``BERT``, sentence
  embeddings as sentence-transformers makes them (``SentenceEncoder``, ``npformer embed``), and
  masks filled by a ``BertForMaskedLM`` directory (``fill_mask``, ``npformer fill-mask --model DIR``);
* :mod:`npformer.pretrained.gpt2`: GPT-2 directories into ``GPT`` (Conv1D weights transposed), and
  back to Hugging Face names; ``complete`` samples from one (``npformer generate --model DIR``);
* :mod:`npformer.pretrained.tokenizer`: a directory's ``tokenizer.json``, checked against its model
  when read (``load_tokenizer``), and text refused where it would be read as the unknown token
  (``encode_known``).

Weights are read with NumPy (:mod:`npformer.interop`) and text is tokenised with the ``tokenizers``
package: the optional extra ``pip install "npformer[pretrained]"``, imported only when a loader runs.
"""
from npformer.pretrained.bert import (REQUIRED_FILES, SentenceEncoder, TokenizerInfo, bert_config_from_hf,
                                      default_minilm_path, fill_mask, hf_bert_state_dict, l2_normalize,
                                      load_bert, mean_pool)
from npformer.pretrained.gpt2 import (GPT2_REQUIRED_FILES, complete, gpt2_config_from_hf,
                                      gpt2_to_hf_state_dict, hf_gpt2_state_dict, load_gpt2,
                                      load_gpt2_tokenizer)
from npformer.pretrained.tokenizer import encode_known, load_tokenizer

__all__ = ["load_bert", "SentenceEncoder", "TokenizerInfo", "default_minilm_path", "bert_config_from_hf",
           "hf_bert_state_dict", "mean_pool", "l2_normalize", "fill_mask", "REQUIRED_FILES",
           "load_gpt2", "load_gpt2_tokenizer", "gpt2_config_from_hf", "hf_gpt2_state_dict",
           "gpt2_to_hf_state_dict", "complete", "GPT2_REQUIRED_FILES", "load_tokenizer", "encode_known"]
