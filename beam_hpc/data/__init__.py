"""The recipe's data: prepare (DAPO-Math-17K, AIME2025) and the tiny synthetic set.
"""
