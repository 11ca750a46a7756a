"""plan/passes"""
