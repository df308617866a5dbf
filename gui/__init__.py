"""ShardScope's two faces: the Qt application and the ``shardscope`` command line.

Never imports torch: training runs in child processes. Qt is imported only when the
window opens, so the command line starts fast.
"""
