"""Host-side data for training: character vocabularies, built-in seq2seq tasks, char-level LM text.

Everything here is plain Python and NumPy (int64 id arrays, bool padding masks); a trainer moves
batches to its backend with :func:`npformer.backend.to_device`.
"""
from npformer.data.corpus import CharLMData, load_corpus
from npformer.data.tasks import (DATE_FORMATS, TASKS, Seq2SeqBatch, Seq2SeqTask, exact_match,
                                 format_date, get_task, number_to_words)
from npformer.data.vocab import BOS_ID, EOS_ID, PAD_ID, SPECIALS, UNK_ID, CharVocab

__all__ = ["CharVocab", "SPECIALS", "PAD_ID", "BOS_ID", "EOS_ID", "UNK_ID",
           "Seq2SeqTask", "Seq2SeqBatch", "get_task", "TASKS", "exact_match", "DATE_FORMATS",
           "format_date", "number_to_words", "CharLMData", "load_corpus"]
