"""What the optional extra ``npformer[pretrained]`` is for: tokenizing text with the ``tokenizers``
package (imported only when a tokenizer is loaded). Model directories and their safetensors weights
are read by :mod:`npformer.interop`, with NumPy alone."""
INSTALL = 'pip install "npformer[pretrained]"'
