"""actors/executor/models"""
